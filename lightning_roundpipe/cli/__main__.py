import sys

from lightning_roundpipe.cli import main

sys.exit(main())
