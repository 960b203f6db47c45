import sys

from asyncckpt.cli import main

sys.exit(main())
