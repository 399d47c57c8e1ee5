"""The parts of a :class:`~polyak.Pusher`, each on its own thread.

::

    training thread ──push──► PushQueue ──► CopyThread (deferred parameter copies)
                                  │
                                  ▼
                               Sender: Encoding ──► Connection slot ──► server

- :mod:`.queue`: :class:`PushQueue`, the bounded queue of filled host
  bodies and their pool, with the one lock every part waits on, and the
  failure kept for the training thread.
- :mod:`.copier`: :class:`CopyThread`, the deferred parameter copies.
- :mod:`.encoding`: what a body becomes on the wire (as is, or zstd);
  runs on the sender's thread, never the training thread's.
- :mod:`.sender`: :class:`Sender`, which takes bodies in step order,
  encodes them and PUTs them on its connection slots with retries.
- :mod:`.stats`: the counters and :class:`PushStats`.

None of them imports :mod:`polyak.pusher`; the pusher wires them together.
"""
