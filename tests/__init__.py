"""The test suite, a package: helpers import as ``tests.helpers.*``, rank jobs start as ``python -m tests.…``."""
