from pdgate.cli import main

main()
