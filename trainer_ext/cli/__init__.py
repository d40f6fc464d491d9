"""The ``trainer-ext`` command line (``trainer_ext.cli.main:main``)."""
