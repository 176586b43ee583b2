from pdgate.planes.cli import main

main()
