"""The SDK's side of a cloud: talking to any OpenAI-compatible endpoint over HTTP.

``client`` (:class:`~edgecloud.remote.client.CloudBackend`: the request body, reading
server-sent events, mapping HTTP failures onto :mod:`edgecloud.errors`, scoring and session
requests) and ``retry`` (when the same URL is tried again). Nothing here serves; the
self-hosted endpoint is :mod:`edgecloud.serving`.
"""
