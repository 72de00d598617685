"""``pipeq launch``: the command line, job files, the trainer loop, run directories and node agents."""
