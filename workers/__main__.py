from workers.worker import main

main()
