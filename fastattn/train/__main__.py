from fastattn.train.command import main

main()
