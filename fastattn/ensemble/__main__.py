"""python -m fastattn.ensemble, and the fastattn-ensemble script."""

from fastattn.cli import starting


def main() -> None:
    with starting("ensemble"):
        from fastattn.inference.ensemble_command import main as ensemble
    ensemble()


if __name__ == "__main__":
    main()
