"""python train.py [group=option ...] [key=value ...]   (see conf/train.yaml and the README)"""

from textrl.cli.train import main

if __name__ == "__main__":
    main()
