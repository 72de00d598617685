"""Traces: the file format every stage's timeline is written in, its report and its pictures."""

from pipeq.trace.format import *  # noqa: F401,F403
from pipeq.trace.format import __all__  # noqa: F401
