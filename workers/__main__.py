from workers.process import main

main()
