"""Associated Learning (Kao and Chen, Neural Computation 2021; Wu et al., ICLR 2022): local losses, messages that flow forward only.

The schedule (:class:`AssociatedLearning`, :mod:`.schedule`) is pure and imported with
:mod:`pipeq.research`; the layers and builders (:mod:`.models`) and the executor
(:mod:`.executor`) import torch. Users name them all from :mod:`pipeq.research`
(``pipeq.research.build_al``, ``pipeq.research.ALModel``).
"""

from pipeq.research.al.schedule import AssociatedLearning

__all__ = ["AssociatedLearning"]
