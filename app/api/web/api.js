// wavefarm's web page, part 1 of 2: talking to the API. Every /v1 call carries
// `Authorization: Bearer <token>` when a token is given. An <audio src> or a link cannot send that
// header, so with a token (or on a server that needs one) audio and downloads are fetched with it and
// handed to the element as blob: URLs. API errors (the Problem JSON: {"error", "reason"}) become
// ApiError and are shown where they happened, never dropped. Page data is only ever set as text
// (textContent), never as HTML: book titles and error reasons come from users.
//
// Plain scripts, no framework and no build step, served by app/api/web.py; app.js (the forms and the
// cards) runs after this one and uses what it declares.
"use strict";

const TOKEN_KEY = "wavefarm.token";
const TOKEN_REQUIRED = document.body.dataset.tokenRequired === "true";

const $ = (selector, root = document) => root.querySelector(selector);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === false || value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

// The API ------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, error, reason) {
    super(`${error}: ${reason}`);
    this.status = status;
    this.error = error;
    this.reason = reason;
  }
}

function token() {
  return $("#token").value.trim();
}

function needsHeader() {
  return TOKEN_REQUIRED || token() !== "";
}

async function api(method, path, body) {
  const headers = token() ? {Authorization: `Bearer ${token()}`} : {};
  let response;
  try {
    response = await fetch(path, {method, headers, body});
  } catch (err) {
    throw new ApiError(0, "Unreachable", `the server did not answer (${err.message})`);
  }
  if (!response.ok) throw await problem(response);
  authMessage(null);
  return response;
}

async function problem(response) {
  let error = `HTTP ${response.status}`;
  let reason = response.statusText || "no reason given";
  try {
    const body = await response.json();
    if (body && body.error) ({error, reason} = body);
  } catch {
    // not the API's JSON (a proxy's page, say): the status line is all there is
  }
  const err = new ApiError(response.status, error, reason);
  if (response.status === 401) authMessage(err);
  return err;
}

async function getJson(path) {
  return (await api("GET", path)).json();
}

// Messages -----------------------------------------------------------------------------------------

function show(node, err) {
  node.hidden = !err;
  node.textContent = err ? (err instanceof Error ? err.message : String(err)) : "";
}

function authMessage(err) {
  const node = $("#auth-message");
  if (!err) {
    if (!(TOKEN_REQUIRED && !token())) show(node, null);
    return;
  }
  show(node, `${err.message}. This server needs its API token (WAVEFARM_API_TOKEN): ` +
    (token() ? "the one given was refused." : "enter it above."));
  $("#token").classList.add("wanted");
}

// Audio and downloads --------------------------------------------------------------------------------

async function mediaUrl(path) {
  if (!needsHeader()) return path;  // the browser streams it (and seeks by range requests)
  const blob = await (await api("GET", path)).blob();
  return URL.createObjectURL(blob);
}

function player(path, errorNode) {
  const audio = el("audio", {controls: true, preload: "metadata", "data-path": path});
  mediaUrl(path).then((url) => { audio.src = url; }, (err) => show(errorNode, err));
  return audio;
}

function downloadLink(path, name, errorNode) {
  const link = el("a", {href: path, download: name, class: "download"}, name);
  link.addEventListener("click", async (event) => {
    if (!needsHeader()) return;  // a plain link: the server names the file
    event.preventDefault();
    try {
      const url = await mediaUrl(path);
      const save = el("a", {href: url, download: name, hidden: true});
      document.body.append(save);
      save.click();
      save.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
    } catch (err) {
      show(errorNode, err);
    }
  });
  return link;
}

