import sys

from pddjax.cli import main

sys.exit(main())
