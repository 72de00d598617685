"""The wire: the codec, message kinds, keys, sockets and links between pipeq's processes.

Everyone above this package sends and receives :class:`~pipeq.wire.messages.Message` objects
through the links here, which encode on the way out and decode (and validate) on the way in::

            control (DEALER <-> ROUTER): commands, replies, errors, heartbeats
    driver  <------------------------------------------------------------+
    (control_link.ControlServer)                                         |
      |                                                                  |
    stage 0 --forward (PUSH->PULL)--> stage 1 --forward--> ... stage N-1
    stage 0 <--backward (PULL<-PUSH)-- stage 1 <--backward-- ...
    (each stage receives through a stage_inbox.StageInbox and sends through a
     stage_link.StageSender; its control_link.Heartbeat thread has a DEALER of its own)

    stage a, replica r <--ties (PUSH->PULL, both ways)--> stage b, replica r
    (tie_link.TieLink, tied weights: the gradients of the weights both hold a copy of; a
     group_link.GroupLink: numbered members, a MAC label per directed pair)

    (the replicas of a stage sum their gradients with torch's collectives, not on the wire:
     pipeq.parallel.mesh)

    node agent (control_link.DriverLink) --DEALER--> the driver's ROUTER (multi-host runs)

    stage k, shard 0 --share (gloo broadcast)--> stage k, shards 1..T-1
    (shard_link.ShardLink, tensor parallelism: the lead's messages, as the codec's frames)

A stage process holds one stage or several (its chunks), and receives through one loop::

    event loop --> transport.ProcessTransport (by chunk: each chunk's StageInbox and StageSender)
                     |
                     v
                   inbox.Inbox: the process's one poller; every socket and lane registers in it
                     (each chunk's control socket, data sockets and lanes; the tie links) and
                     every wait goes through it (a torch collective's too: Inbox.until), filing each arrival in its owner's
                     queues.KeyedQueue (a chunk's control queue for commands)

With tensor parallelism, shard 0's event loop sees its ProcessTransport through a
shard_link.LeadTransport (which shares every message it hands the loop), and every other shard's
through a shard_link.FollowerTransport (its commands and data: what shard 0 shared; its sends go
nowhere).

Its modules, by job:

    transport.py     a process's transport, addressed by chunk: the one object the event loop uses
    inbox.py         the process's one poller and wait loop
    stage_inbox.py   one stage's receiving channels: control socket, data sockets, lanes, queues
    stage_link.py    one stage's sending half (StageSender, Outlet): sends, replies to the driver
    queues.py        KeyedQueue: bounded, keyed, whatever the arrival order
    control_link.py  the control channel: the driver's ROUTER, heartbeats, node agents
    group_link.py    GroupLink: a channel to a group of peer processes; tie_link.py is made of it
    tie_link.py      tied weights' channel
    shard_link.py    tensor-parallel shards: the lead shares, the followers replay
    shm.py, lanes.py one host's payloads (shared-memory slots) and hops (lanes)
    cuda_slots.py    one host's device payloads (CUDA IPC slots)
    sockets.py       bind addresses, private ipc directories, socket tuning
    security.py      the job's keys at each tcp handshake, a MAC per data message
    frames.py        a Message to the codec's frames and back, aligned
    errors.py        the wire's exceptions
    codec.py         (the codec layer) messages as a msgpack header plus raw tensor frames
    messages.py      (codec) message kinds and the Message
    control.py       (codec) one typed payload per command and reply; fields.py: their fields
    keys.py          (codec) the job secret and the keys derived from it
    netif.py         (codec) an interface's IPv4 address
"""

__all__: list[str] = []  # nothing: its modules are imported by their own names
