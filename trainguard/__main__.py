"""``python -m trainguard ...`` is the ``trainguard`` command."""

from trainguard.cli.main import main

if __name__ == "__main__":
    main()
