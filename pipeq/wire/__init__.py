"""The wire: the codec, message kinds, keys, sockets and links between pipeq's processes.

Everyone above this package sends and receives :class:`~pipeq.wire.messages.Message` objects
through the links here, which encode on the way out and decode (and validate) on the way in::

            control (DEALER <-> ROUTER): commands, replies, errors, heartbeats
    driver  <------------------------------------------------------------+
    (control_link.ControlServer)                                         |
      |                                                                  |
    stage 0 --forward (PUSH->PULL)--> stage 1 --forward--> ... stage N-1
    stage 0 <--backward (PULL<-PUSH)-- stage 1 <--backward-- ...
    (stage_link.StageTransport, one per stage process; its control_link.Heartbeat thread
     has a DEALER of its own)

    stage k, replica r <--replicas (PUSH->PULL, both ways)--> stage k, replica r'
    (replica_link.ReplicaLink, data parallelism: gradient buckets, replica 0's weights at start)

    stage a, replica r <--ties (PUSH->PULL, both ways)--> stage b, replica r
    (tie_link.TieLink, tied weights: the gradients of the weights both hold a copy of; both
     links are a group_link.GroupLink: numbered members, a MAC label per directed pair)

    node agent (control_link.DriverLink) --DEALER--> the driver's ROUTER (multi-host runs)

    stage k, shard 0 --share (gloo broadcast)--> stage k, shards 1..T-1
    (shard_link.ShardLink, tensor parallelism: the lead's messages, as the codec's frames)

Modules, by job: codec (messages to frames and back), messages (kinds), keys (the job's secret),
netif (interface addresses), security (keys at the handshake, per-message MACs), sockets (bind
addresses, ipc directories, tuning), frames (the links' encode and aligned decode), queues (keyed
queues), errors, shm and lanes (one host's payloads and hops), stage_inbox and stage_link (a
stage's receiving and sending halves), group_link, replica_link, tie_link, control_link, shard_link.
"""

__all__: list[str] = []  # nothing: its modules are imported by their own names
