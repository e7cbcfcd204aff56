"""Pages people read in a browser: a request's timeline (`GET /v1/requests/{id}/timeline` with a
tenant key, `GET /admin/requests/{id}/timeline` with an admin token) and the operator's live
console (`GET /admin/console`). Server-rendered HTML (Jinja2, autoescaped) and SVG; a small
vendored script (the hover card, the console's refresh from the admin JSON endpoints) and a
stylesheet, served from the package under `/pages/static/` (no CDN, no build step). Every page
carries a strict Content-Security-Policy: scripts and styles from this origin only, no inline.

Must not import: gateway.openai, gateway.admin, runtime, scheduler
"""
