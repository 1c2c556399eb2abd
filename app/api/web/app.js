// wavefarm's web page, part 3 of 3: the voice picker, the book and job forms, the pages of earlier
// items, and the polling that keeps each live card current (api.js, loaded first, talks to the API;
// cards.js, loaded second, draws a card per submitted book or job).
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
                      "publisher", "year", "isbn", "genres", "quality"]) {
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
