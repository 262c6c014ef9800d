// Live updates: the server says "change" over Server-Sent Events (/ui/live); we fetch this page
// again and swap its <main>. One fetch at a time; a notice during a fetch triggers one more.
// Without JavaScript the pages are the same, only not live.
(function () {
  "use strict";
  var main = document.getElementById("main");
  if (!main || main.dataset.live !== "on" || !window.EventSource) return;
  var fetching = false;
  var again = false;

  function editing() {
    var active = document.activeElement;
    return active && main.contains(active) && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName);
  }

  function refresh() {
    if (fetching) { again = true; return; }
    if (editing()) return; // never pull a form from under someone typing in it
    fetching = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (response.redirected || !response.ok) { throw new Error("status " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var next = new DOMParser().parseFromString(html, "text/html").getElementById("main");
        if (next) {
          main.innerHTML = next.innerHTML;
          main.dataset.refreshed = String(Date.now());
        }
      })
      .catch(function () { /* the next notice tries again */ })
      .finally(function () {
        fetching = false;
        if (again) { again = false; refresh(); }
      });
  }

  var source = new EventSource("/ui/live");
  source.addEventListener("change", refresh);
  source.addEventListener("open", function () { main.dataset.liveOpen = "yes"; });
})();
