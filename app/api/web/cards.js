// wavefarm's web page, part 2 of 3: a card per submitted book or job, kept in this browser's list and
// updated in place from the API's answers (api.js, loaded first, talks to the API; app.js, loaded last,
// polls the live cards and holds the constants these functions read when they run).

// Cards: one per book or job, updated in place ---------------------------------------------------

const cards = new Map();  // "book:<id>" -> {kind, id, node, live, parts}

function savedItems() {
  try {
    return JSON.parse(localStorage.getItem(ITEMS_KEY) || "[]");
  } catch {
    return [];
  }
}

function saveItems() {
  const items = [...$("#items").children].map((node) => ({kind: node.dataset.kind, id: node.dataset.id}));
  localStorage.setItem(ITEMS_KEY, JSON.stringify(items.slice(0, MAX_ITEMS)));
}

function track(kind, item) {
  const card = addCard(kind, item.id, true);
  render(card, item);
  saveItems();
}

function addCard(kind, id, newest) {
  const key = `${kind}:${id}`;
  if (cards.has(key)) return cards.get(key);
  const card = {kind, id, live: true, parts: {}};
  const cancel = el("button", {type: "button", class: "cancel"}, "Cancel");
  const forget = el("button", {type: "button", class: "forget", title: "remove from this list"}, "×");
  card.parts = {
    title: el("h3"), status: el("span", {class: "status"}), cancel, forget,
    progress: el("progress", {max: 1, value: 0}), summary: el("span", {class: "summary"}),
    error: el("p", {class: "message", role: "alert", hidden: true}),       // the last call's
    failure: el("p", {class: "message failure", role: "alert", hidden: true}),  // the item's own error
    mediaError: el("p", {class: "message", role: "alert", hidden: true}),  // a player's or a download's
    notes: el("ul", {class: "notes", hidden: true}),  // how the audio was made: dummy weights, ...
    body: el("div", {class: "body"}),
  };
  const p = card.parts;
  card.node = el("article", {class: `card ${kind}`, "data-kind": kind, "data-id": id},
    el("header", {}, p.title, p.status, cancel, forget),
    el("div", {class: "meter"}, p.progress, p.summary), p.notes, p.error, p.failure, p.mediaError, p.body);
  cancel.addEventListener("click", () => cancelItem(card));
  forget.addEventListener("click", () => {
    cards.delete(key);
    card.node.remove();
    saveItems();
  });
  const list = $("#items");
  if (newest) list.prepend(card.node);
  else list.append(card.node);
  cards.set(key, card);
  return card;
}

async function refresh(card) {
  try {
    const item = await getJson(`/v1/${card.kind}s/${card.id}`);
    show(card.parts.error, null);
    render(card, item);
  } catch (err) {
    show(card.parts.error, err);
    if (err.status === 404) card.live = false;  // removed on the server: nothing more to follow
  }
}

async function cancelItem(card) {
  try {
    render(card, await (await api("POST", `/v1/${card.kind}s/${card.id}/cancel`)).json());
  } catch (err) {
    show(card.parts.error, err);
  }
}

function render(card, item) {
  card.live = LIVE[card.kind].includes(item.status);
  const p = card.parts;
  p.status.textContent = item.status;
  p.status.className = `status ${item.status}`;
  p.cancel.hidden = !card.live;
  if (card.kind === "book") renderBook(card, item);
  else renderJob(card, item);
  renderNotes(p, item.notes || []);
  // A cancelled item's error is the word "cancelled" again: the status says it already.
  show(p.failure, item.error && item.error !== item.status ? `${item.status}: ${item.error}` : null);
}

function seconds(s) {
  return s === null || s === undefined ? "" : `${Number(s).toFixed(1)} s`;
}

function renderBook(card, book) {
  const p = card.parts;
  p.title.textContent = (book.title || "(untitled book)") + (book.author ? `, by ${book.author}` : "") +
    (book.narrator ? `, read by ${book.narrator}` : "") +
    (book.chapters_selected ? ` · chapters ${book.chapters_selected}` : "");
  p.progress.max = Math.max(book.segments_total, 1);
  p.progress.value = book.segments_done;
  const eta = book.eta_s !== null && card.live ? ` · about ${Math.ceil(book.eta_s)} s to go` : "";
  const lengths = book.chapters.map((c) => c.seconds);
  const length = lengths.length && lengths.every((s) => s !== null)
    ? ` · ${seconds(lengths.reduce((a, b) => a + b, 0))} long with its pauses` : "";
  p.summary.textContent = book.status === "parsing"
    ? `reading the book on a CPU worker (${book.parse_lane} lane, waited ${Math.round(book.parse_wait_s)} s; ` +
      "its chapters appear once it is read)"
    : `${book.segments_done}/${book.segments_total} segments · ` +
      `${seconds(book.audio_seconds)} of speech${length}${eta}`;
  if (!p.chapters) {
    p.chapters = el("table", {class: "chapters"});
    p.whole = el("div", {class: "whole"});
    p.files = el("ul", {class: "files"});
    p.body.append(p.chapters, p.whole, p.files);
  }
  for (const chapter of book.chapters) renderChapter(card, chapter);
  // The gate hears a chapter before it is assembled: its report is fetched again when a chapter is
  // assembled or the status changes, not on every poll (it is O(segments) on the server).
  const heard = `${book.status}:${book.chapters.filter((c) => c.seconds !== null).length}`;
  if (book.status !== "parsing" && p.body.dataset.heard !== heard) {
    p.body.dataset.heard = heard;
    getJson(`/v1/books/${book.id}/quality`).then((report) => renderQuality(card, report),
                                                  (err) => show(p.error, err));
  }
  const m4b = book.files["book.m4b"];
  if (m4b && !p.whole.childElementCount) {
    p.whole.append(el("span", {class: "label"}, "Whole book"), player(m4b, p.mediaError));
  }
  const names = Object.keys(book.files).sort();
  if (p.files.dataset.names !== names.join(",")) {
    p.files.dataset.names = names.join(",");
    p.files.replaceChildren(...names.map((name) => el("li", {}, downloadLink(book.files[name], name, p.mediaError))));
  }
}

function renderChapter(card, chapter) {
  const table = card.parts.chapters;
  let row = $(`tr[data-index="${chapter.index}"]`, table);
  if (!row) {
    row = el("tr", {class: "chapter", "data-index": chapter.index},
      el("td", {class: "n"}, String(chapter.index + 1)), el("td", {class: "title"}),
      el("td", {}, el("progress", {max: 1, value: 0})), el("td", {class: "summary"}), el("td", {class: "media"}));
    table.append(row);
  }
  $(".title", row).textContent = chapter.title;
  const bar = $("progress", row);
  bar.max = Math.max(chapter.segments_total, 1);
  bar.value = chapter.segments_done;
  const loudness = chapter.loudness_lufs !== null && chapter.true_peak_dbtp !== null
    ? ` · ${chapter.loudness_lufs.toFixed(1)} LUFS, peak ${chapter.true_peak_dbtp.toFixed(1)} dBTP` : "";
  $(".summary", row).textContent = `${chapter.segments_done}/${chapter.segments_total} · ` +
    (chapter.seconds !== null ? seconds(chapter.seconds) : `${seconds(chapter.audio_seconds)} so far`) + loudness;
  const media = $(".media", row);
  if (chapter.file_url && media.dataset.url !== chapter.file_url) {
    media.dataset.url = chapter.file_url;
    media.replaceChildren(player(chapter.file_url, card.parts.mediaError));
  }
}

const OUTCOME_WORDS = [["passed", "passed"], ["rerendered", "re-rendered"], ["failed", "failed (kept)"],
                       ["unheard", "not heard"]];

function renderQuality(card, report) {  // GET /v1/books/{id}/quality, as the quality gate heard the book
  const p = card.parts;
  if (!p.quality) {
    p.quality = el("section", {class: "quality"});
    p.body.insertBefore(p.quality, p.whole);
  }
  const t = report.totals;
  const counts = OUTCOME_WORDS.map(([key, words]) => `${t[key]} ${words}`).join(" · ");
  const checks = Object.entries(report.checks)
    .filter(([, v]) => v.pass + v.fail + v.skipped > 0)
    .map(([name, v]) => el("li", {"data-check": name}, `${name}: ` +
      [[v.pass, "passed"], [v.fail, "failed"], [v.skipped, "skipped"]]
        .filter(([n]) => n > 0).map(([n, w]) => `${n} ${w}`).join(", ")));
  const worst = report.worst.map((w) => el("li", {class: "worst", "data-key": w.key},
    el("span", {}, `Chapter ${w.chapter + 1}, segment ${w.key.slice(0, 12)} · ${w.attempts} renders · ` +
      w.reasons.join("; ")),
    w.text ? el("q", {class: "text"}, w.text) : null,
    player(w.audio, p.mediaError)));
  p.quality.replaceChildren(
    el("p", {class: "quality-summary"}, `Quality gate ${report.mode}: ${counts}`),
    ...report.notes.map((note) => el("p", {class: "quality-note"}, `Note: ${note}`)),
    el("ul", {class: "checks"}, ...checks),
    worst.length ? el("p", {class: "label"}, "Kept with a failure (worst first)") : null,
    worst.length ? el("ol", {class: "worst"}, ...worst) : null);
}

function renderNotes(p, notes) {  // a job's or a book's: dummy weights, the stand-in tokenizer
  if (p.notes.dataset.notes !== notes.join("\n")) {  // said plainly: such audio is noise
    p.notes.dataset.notes = notes.join("\n");
    p.notes.replaceChildren(...notes.map((note) => el("li", {}, `Note: ${note}`)));
    p.notes.hidden = !notes.length;
  }
}

function jobProgress(job) {  // floored: a sliver of a job is never "1 %"; an ended job says how it ended
  const percent = `${Math.floor(job.progress.fraction * 100)} %`;
  if (job.status !== "cancelled" && job.status !== "failed") return percent;
  return job.progress.frames_done ? `${job.status} at ${percent}` : `${job.status} before any audio`;
}

function renderJob(card, job) {
  const p = card.parts;
  p.title.textContent = `Job ${job.id.slice(0, 8)}` + (job.kind === "text" ? ` · “${job.text.slice(0, 60)}”` : "");
  p.progress.max = Math.max(job.progress.frames_total, 1);
  p.progress.value = job.progress.frames_done;
  p.summary.textContent = job.kind === "text" && job.n_tokens === 0 && card.live
    ? "making speech tokens from the text" : `${jobProgress(job)} · ` +
    `${seconds(job.n_tokens / 25)} of audio · ${job.n_tokens} tokens`;
  if (job.audio_url && !p.body.childElementCount) {
    const name = `${job.id}.${job.output_format}`;
    p.body.append(player(job.audio_url, p.mediaError), downloadLink(job.audio_url, name, p.mediaError));
  }
}
