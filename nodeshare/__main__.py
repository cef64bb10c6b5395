from nodeshare.cli import main

main()
