"""omniloop-io: what crosses a front end's boundary — media files (:mod:`omniloop_io.media`: mp4 with
an optional AAC track, png/webp, input images, audio wav/flac/mp3/Ogg Opus/AAC/pcm) and the request's
JSON Schema (:mod:`omniloop_io.jsonschema`: ``omniloop schema``, the server's ``/openapi.json``).
Moved out of the core (``omniloop.media``, ``omniloop.jsonschema``; issue 34): the runtime reads and
writes no files. A library (no entry point); importing this package imports neither torch nor PyAV.
"""
