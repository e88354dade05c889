"""The live dashboard of `kvflow serve` (/dashboard): the engine's steps, requests and KV pool as they
happen, streamed to the browser as server-sent events.

    engine thread                      event loop                          browser
    StepRecorder (after every step) -> DashboardHub (window, coalescing) -> /dashboard/events (SSE)
                                                                           /dashboard (the page)

recorder.py  the engine-thread observer: step rows, request rows, ITL gaps, the block map; a delta
             at most every `interval_s` (and when the engine goes idle)
schema.py    the rows' layouts and the frame's fields (docs/dashboard.md has them for readers)
hub.py       the event-loop side: the last N minutes kept for new clients, one bounded queue per
             client, a client that stops reading dropped instead of waited for
window.py    the per-second series and the window's pruning
stream.py    the SSE response (keep-alives, disconnects, a dropped client's connection closed)
routes.py    the routes: the page, its static files, the event stream, the doctor's view
doctor_window.py  what the doctor view is handed (plain data; the doctor is passed in from above)
setup.py     one Dashboard per server: the recorder subscribed to the engine, the hub, the routes
static/      the page (HTML/JS/CSS) and uPlot 1.6.32 as published on npm (MIT, its licence beside it)
"""
