"""The wire format (docs/wire-format.md): the host format (v5) and the device format (v6).

`codec` encodes and decodes payloads; the format's parts are a module each: `frame` (frame
head, trailer, sections), `header` (the JSON header's schema), `positions` (`runs` and the
checks of positions), `gaps` (`gaps_rans`), `rans` (rANS streams), `joint` (v5's joint
stream), `prefix` (v6's prefix codes), `values` (value encodings and the op choice),
`varints`, `versions` and `errors`. Import the module you need (`from nemo_dcr.wire import
codec`): this package imports nothing itself, so that `versions` can be read where the
compiled kernels must not load yet (see there).
"""
