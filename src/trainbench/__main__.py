import sys

from trainbench.cli import main

sys.exit(main())
