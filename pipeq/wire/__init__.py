"""The wire: the codec, message kinds, keys, sockets and links between pipeq's processes."""
