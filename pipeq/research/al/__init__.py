"""Associated Learning (Kao and Chen, ICLR 2022): local losses, messages that flow forward only."""

from pipeq.research.al.executor import *  # noqa: F401,F403
from pipeq.research.al.executor import __all__  # noqa: F401
