"""Ready-made models cut into pipeline stages (ResNets with auxiliary heads: :mod:`pipeq.models.resnet`)."""

from pipeq.models import resnet

__all__ = ["resnet"]
