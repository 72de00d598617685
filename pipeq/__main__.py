"""``python -m pipeq ...``: the pipeq command (also how torchrun starts it: ``-m pipeq launch``)."""

import sys

from pipeq.launch.cli import main

sys.exit(main())
