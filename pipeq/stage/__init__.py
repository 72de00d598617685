"""One stage's compute: forward, backward and step, numerics, microbatches and lr schedulers."""
