"""omniloop-tone-demo: the ``tone-demo`` text-to-audio preset (family ``stable-audio``), its prompt
grammar (:mod:`omniloop_tone_demo.grammar`) and evaluator (:mod:`omniloop_tone_demo.evaluate`)."""

__version__ = "0.1.0"
