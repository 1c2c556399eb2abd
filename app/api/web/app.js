// wavefarm's web page, part 2 of 2: the voice picker, the book and job forms, and a card per submitted
// book or job, polled every second while it is live (api.js, loaded first, talks to the API).
"use strict";

const POLL_MS = 1000;
const ITEMS_KEY = "wavefarm.items";    // [{kind: "book" | "job", id}], newest first
const MAX_ITEMS = 30;
const LIVE = {book: ["parsing", "queued", "rendering", "assembling"], job: ["queued", "preparing", "running"]};

// The token, kept for this tab (sessionStorage) or on this device (localStorage) -------------------

function loadToken() {
  const saved = localStorage.getItem(TOKEN_KEY);
  $("#remember").checked = saved !== null;
  $("#token").value = saved ?? sessionStorage.getItem(TOKEN_KEY) ?? "";
  if (TOKEN_REQUIRED && !token()) {
    show($("#auth-message"), "This server needs its API token (WAVEFARM_API_TOKEN): enter it above.");
  }
}

function saveToken(event) {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, token());
  if ($("#remember").checked) localStorage.setItem(TOKEN_KEY, token());
  else localStorage.removeItem(TOKEN_KEY);
  $("#token").classList.remove("wanted");
  show($("#auth-message"), null);
  loadVoices();
  for (const card of cards.values()) refresh(card);
}

// Voices -----------------------------------------------------------------------------------------

async function loadVoices() {
  const select = $("#voice-id");
  const chosen = select.value;
  try {
    const voices = await getJson("/v1/voices");
    select.replaceChildren(select.options[0]);
    for (const voice of voices) {
      const who = voice.name ? `${voice.name} (${voice.id.slice(0, 8)}…)` : `${voice.id.slice(0, 12)}…`;
      const label = `${who} ${voice.status}, ${voice.uses} uses`;
      select.append(el("option", {value: voice.id, selected: voice.id === chosen}, label));
    }
    show($("#voice-message"), null);
  } catch (err) {
    show($("#voice-message"), err);
  }
}

function addVoice(data) {
  const file = $("#reference").files[0];
  const voiceId = $("#voice-id").value;
  if (file) data.append("reference", file);
  else if (voiceId) data.append("voice_id", voiceId);
  else throw new Error("Choose a voice first: upload a reference file or pick a stored voice.");
}

// Forms ------------------------------------------------------------------------------------------

function bookForm(form, submitter) {
  const data = new FormData();
  data.append("book", form.elements.book.files[0]);
  for (const name of ["title", "author", "narrator", "language", "chapters", "output_format", "target_lufs",
                      "bitrate_kbps", "mp3_bitrate_kbps", "sample_rate", "series", "series_part",
                      "publisher", "year", "isbn", "genres"]) {
    const value = form.elements[name].value.trim();
    if (value) data.append(name, value);
  }
  data.append("m4b", form.elements.m4b.checked ? "true" : "false");
  data.append("mp3", form.elements.mp3.checked ? "true" : "false");
  data.append("epub3", form.elements.epub3.checked ? "true" : "false");
  if (submitter && submitter.name === "preview") {  // one chapter's first seconds, at a high priority
    data.set("preview_s", submitter.value);
    for (const name of ["m4b", "mp3", "epub3"]) data.set(name, "false");
    data.set("priority", "5");
  }
  addVoice(data);
  return data;
}

function jobForm(form) {
  const data = new FormData();
  const tokens = form.elements.tokens.files[0];
  const text = form.elements.text.value.trim();
  if (tokens && text) throw new Error("Give a tokens file or text, not both.");
  if (tokens) {
    data.append("tokens", tokens);
  } else if (text) {
    data.append("text", text);
    const language = form.elements.language.value.trim();
    if (language) data.append("language", language);
  } else {
    throw new Error("Choose a tokens file or type some text.");
  }
  data.append("output_format", form.elements.output_format.value);
  addVoice(data);
  return data;
}

function onSubmit(form, kind, build) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const message = $(".message", form);
    const button = $("button[type=submit]", form);
    button.disabled = true;
    try {
      const item = await (await api("POST", `/v1/${kind}s`, build(form, event.submitter))).json();
      show(message, null);
      track(kind, item);
      if ($("#reference").files[0]) loadVoices();
    } catch (err) {
      show(message, err);
    } finally {
      button.disabled = false;
    }
  });
}

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

// Everything on the server, newest first, a page at a time (the X-Next-Cursor header) ---------------

const PAGE_SIZE = 20;
const cursors = {job: "", book: ""};  // the next page's cursor; "" before the first page

async function loadMore(button) {
  const kind = button.dataset.kind;
  const after = cursors[kind] ? `&after=${encodeURIComponent(cursors[kind])}` : "";
  try {
    const response = await api("GET", `/v1/${kind}s?limit=${PAGE_SIZE}${after}`);
    for (const item of await response.json()) render(addCard(kind, item.id, false), item);
    cursors[kind] = response.headers.get("X-Next-Cursor") || "";
    if (!cursors[kind]) {
      button.disabled = true;
      button.textContent = `All ${kind}s shown`;
    }
    show($("#more-error"), null);
  } catch (err) {
    show($("#more-error"), err);
  }
}

// Dummy weights: /healthz counts the live GPU workers that run them --------------------------------

const HEALTH_MS = 15000;

async function checkWeights() {
  try {
    const health = await (await fetch("/healthz")).json();
    const n = health.dummy_weights_workers || 0;
    const banner = $("#dummy-banner");
    banner.hidden = n === 0;
    banner.textContent = n === 0 ? "" : `${n} GPU worker${n === 1 ? " runs" : "s run"} dummy weights ` +
      "(no WAVEFARM_MODEL_DIR): the audio is noise, not speech. See docs/MODEL_SETUP.md.";
  } catch {
    // the server not answering shows on the next API call
  }
  setTimeout(checkWeights, HEALTH_MS);
}

// Start ------------------------------------------------------------------------------------------

async function poll() {
  await Promise.all([...cards.values()].filter((card) => card.live).map(refresh));
  setTimeout(poll, POLL_MS);
}

function start() {
  loadToken();
  $("#auth-form").addEventListener("submit", saveToken);
  $("#voices-refresh").addEventListener("click", loadVoices);
  onSubmit($("#book-form"), "book", bookForm);
  onSubmit($("#job-form"), "job", jobForm);
  for (const id of ["#more-jobs", "#more-books"]) {
    $(id).addEventListener("click", (event) => loadMore(event.currentTarget));
  }
  for (const {kind, id} of savedItems()) {
    if (LIVE[kind]) addCard(kind, id, false);
  }
  loadVoices();
  checkWeights();
  poll();
}

start();
