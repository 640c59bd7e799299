"""Built-in collectors, one module each; importing a module registers its collector."""
