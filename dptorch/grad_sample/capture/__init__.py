"""The controller: ``GradSampleHooks`` attaches to the user's model, captures each layer call, hands
the calls to its mode's strategy and answers the optimizer; it coordinates its collaborators
(``attachment.py``, ``session.py``, ``calls.py``, ``backward.py``, ``replays.py``, ``rounds.py``,
``sharding.py``, ``wrapper_tags.py``, ``settings.py``: see ``hooks.py``); ``wrapper.py`` the optional
``GradSampleModule``; ``dp_loss.py`` the per-sample loss wrapper; ``claims.py`` which controller
captures each parameter; ``buffer_check.py`` buffers a training forward fills from the batch.
"""
