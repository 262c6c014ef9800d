"""The operator pages under /ui/: server-rendered HTML (Jinja2 templates in templates/), a little
plain JavaScript for live updates (static/), a browser session signed in with an admin key.

`app.py` builds them and serves them beside the API; `sessions.py` signs in and out and checks
every form's CSRF token; `roles.py` decides what a signed-in operator may do; `pages.py` reads and
renders; `actions.py` changes things and audits each change; `live.py` streams change notices.
"""
