import sys

from jetserve.cli import main

sys.exit(main())
