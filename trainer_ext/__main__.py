"""``python -m trainer_ext …``: the same as the ``trainer-ext`` command."""

from trainer_ext.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
