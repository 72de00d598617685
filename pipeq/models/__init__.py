"""Ready-made models cut into pipeline stages (ResNets with auxiliary heads)."""

__all__ = ["resnet"]
