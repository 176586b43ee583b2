"""The request path: keys, cancel scopes, the request's context, admission, the gate and its leases, the legs,
the relay, the outcome, the routes of the translated APIs, and the gateway that assembles them
(``docs/architecture.md``, "One request's way")."""
