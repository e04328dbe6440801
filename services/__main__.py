from services.server import main

main()
