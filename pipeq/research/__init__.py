"""Research schedules, each a plug-in with its own executor: interlocking backprop, asynchronous 1F1B, Associated Learning."""
