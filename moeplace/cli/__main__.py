"""``python -m moeplace.cli``: the ``place`` command."""
import sys

from moeplace.cli.main import main

sys.exit(main())
