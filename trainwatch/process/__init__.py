"""Processes trainwatch starts and stops: children that die with their parent and trees
waited for (``proctree``), and the stop signals of the long-running commands
(``stopsignals``)."""
