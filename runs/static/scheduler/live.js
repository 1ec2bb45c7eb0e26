/* Watch a run live: the run page (and the job page's latest run) polls the staff-only
   JSON view under /admin/ (runs/admin.py RunAdmin.live_view) with the session, and
   redraws the status, the timeline and the next run as they change. A file, not an
   inline script: the Content-Security-Policy allows script-src 'self' only. */
(function () {
  "use strict";
  var POLL_MS = 1000;
  var AFTER_END = 3; // polls after the run ended: its next run is written in the same transaction

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }

  function badge(status) { return el("span", {"class": "badge badge-" + status}, status); }

  function setStatus(target, run) {
    if (!target) { return; }
    target.textContent = "";
    target.appendChild(badge(run.status));
    if (run.held && (run.status === "scheduled" || run.status === "queued")) {
      target.appendChild(document.createTextNode(" "));
      target.appendChild(badge("held"));
    }
  }

  function row(event, fresh) {
    var tr = el("tr", {"class": "event-" + event.type + (fresh ? " live-new" : "")});
    var at = el("td"); at.appendChild(el("code", {}, event.at)); tr.appendChild(at);
    var type = el("td"); type.appendChild(el("strong", {"class": "event-type"}, event.type)); tr.appendChild(type);
    tr.appendChild(el("td", {}, event.fence));
    tr.appendChild(el("td", {}, event.worker));
    tr.appendChild(el("td", {}, event.answer));
    tr.appendChild(el("td", {}, event.detail));
    var state = el("td"); state.appendChild(badge(event.state)); tr.appendChild(state);
    tr.appendChild(el("td", {}, event.seconds_in_state === null ? "" : event.seconds_in_state.toFixed(3) + " s"));
    return tr;
  }

  function drawTimeline(run, shown) {
    var body = document.getElementById("timeline-rows");
    if (!body) { return shown; }
    body.textContent = "";
    run.events.forEach(function (event, i) { body.appendChild(row(event, i >= shown)); });
    var spent = document.getElementById("time-in-state");
    if (spent) {
      var parts = Object.keys(run.seconds_by_state).map(function (s) {
        return s + " " + run.seconds_by_state[s].toFixed(3) + " s";
      });
      spent.textContent = parts.length ? "Time in each state: " + parts.join("; ") : "";
    }
    return run.events.length;
  }

  function drawNext(run) {
    var next = document.getElementById("next-run");
    if (!next || !run.next_run) { return; }
    next.textContent = "";
    next.appendChild(el("a", {"href": run.next_run.url}, run.next_run.id));
    next.appendChild(document.createTextNode(" at " + run.next_run.scheduled_for.slice(0, 19) + "Z "));
    next.appendChild(badge(run.next_run.status));
  }

  function drawFields(run) {
    var names = {"attempt": run.attempt, "fence": run.fence, "lease_owner": run.lease_owner, "lease_expires_at": run.lease_expires_at,
                 "started_at": run.started_at, "finished_at": run.finished_at, "queued_at": run.queued_at,
                 "due_at": run.due_at, "last_error": run.last_error};
    Object.keys(names).forEach(function (name) {
      var field = document.querySelector(".field-" + name + " .readonly");
      var value = names[name];
      if (field) { field.textContent = value === null || value === "" ? "-" : String(value).replace(/\.\d+Z$/, "Z"); }
    });
  }

  function watch(url, onRun) {
    var note = document.getElementById("live-note");
    var left = AFTER_END;
    var timer = null;
    function poll() {
      fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
        .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.json(); })
        .then(function (run) {
          onRun(run);
          if (!run.open) { left -= 1; }
          if (left <= 0) {
            if (note) { note.textContent = "(ended; live updates stopped)"; }
            return;
          }
          if (note) { note.textContent = "(live: updates every second)"; }
          timer = window.setTimeout(poll, POLL_MS);
        })
        .catch(function (err) {
          if (note) { note.textContent = "(live updates paused: " + err.message + "; retrying)"; }
          timer = window.setTimeout(poll, POLL_MS * 5);
        });
    }
    poll();
    return function () { if (timer) { window.clearTimeout(timer); } };
  }

  document.addEventListener("DOMContentLoaded", function () {
    var timeline = document.getElementById("timeline");
    if (timeline && timeline.dataset.liveUrl) {
      var shown = document.querySelectorAll("#timeline-rows tr").length;
      watch(timeline.dataset.liveUrl, function (run) {
        setStatus(document.getElementById("run-status"), run);
        drawFields(run);
        shown = drawTimeline(run, shown);
        drawNext(run);
      });
    }
    // The job page: its latest run's status, kept up to date the same way.
    var latest = document.getElementById("latest-run");
    if (latest && latest.dataset.liveUrl) {
      watch(latest.dataset.liveUrl, function (run) {
        setStatus(document.getElementById("latest-run-status"), run);
        var last = run.events.length ? run.events[run.events.length - 1] : null;
        var step = document.getElementById("latest-run-step");
        if (step && last) { step.textContent = last.type + " at " + last.at; }
      });
    }
  });
})();
