import sys

from verl_cppack.cli import main

sys.exit(main())
