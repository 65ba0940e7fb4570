"""omniloop-rl: post-training against a serving runtime. :mod:`omniloop_rl.weights` reads and checks
``Runtime.update_weights``' sources and computes ``Runtime.weights_checksum`` (the on-device
``mix128``; a trainer computes the same value from its copy), through the ``weights`` mechanism
:mod:`omniloop_rl.plugin` registers; :mod:`omniloop_rl.trainer` is what a trainer computes (a
recorded step's log-prob, the DiffusionNFT objective, replay). Moved out of the core (issue 34); the
rollout steps the runtime takes stay in ``omniloop.rl``. See docs/rl.md.
"""
