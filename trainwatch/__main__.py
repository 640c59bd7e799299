from trainwatch.cli import main

main()
