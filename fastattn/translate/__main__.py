"""python -m fastattn.translate, and the fastattn-translate script."""

from fastattn.cli import starting


def main() -> None:
    with starting("translate"):
        from fastattn.inference.translate_command import main as translate
    translate()


if __name__ == "__main__":
    main()
