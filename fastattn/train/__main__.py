"""python -m fastattn.train, and the fastattn-train script."""

from fastattn.cli import starting


def main() -> None:
    with starting("train"):
        from fastattn.train.command import main as train
    train()


if __name__ == "__main__":
    main()
