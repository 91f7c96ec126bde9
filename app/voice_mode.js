// Voice mode: hands-free. While a composer's "Voice mode" is on, its microphone records whenever no question is being
// transcribed; a pause of QUIET_MS after speech ends the recording, whose words are sent as soon as they land in the
// box, the reply is read aloud, and listening goes on. Speaking while a reply streams or is read stops it (the
// composer's Stop), and that speech is the next question.
//
// The microphone's troubles, said under it in words with how to fix them: a page that is neither https nor on this
// machine (browsers give such pages no microphone), a microphone the browser blocked, none at all.
const MIC_HELP = {
  insecure: "The microphone works on this machine's own address or over https: on a phone, open the --share link " +
    "(browsers give a plain-http page on another computer no microphone).",
  NotAllowedError: "The microphone is blocked for this page: click the icon left of the address bar (a lock or a " +
    "microphone), allow the microphone, then reload the page.",
  NotFoundError: "No microphone was found: plug one in (or pick it in your system's sound settings), then reload.",
};
function micHelp(text) {
  for (const prefix of composers) {
    const help = document.getElementById(`${prefix}-mic-help`);
    if (help) help.textContent = text;
  }
}
if (!window.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
  setInterval(() => micHelp(MIC_HELP.insecure), 1000);  // the components come after the page
} else {
  const ask = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
  navigator.mediaDevices.getUserMedia = async (constraints) => {
    try {
      const stream = await ask(constraints);
      if (constraints?.audio) micHelp("");
      return stream;
    } catch (e) {
      if (constraints?.audio) micHelp(MIC_HELP[e.name] || `The microphone could not be opened (${e.name}: ${e.message}).`);
      throw e;
    }
  };
}
(() => {
  const QUIET_MS = 1200, LOUD = 0.03;  // a pause that ends a question; the level (RMS) that counts as speech
  const SHORTEST_MS = 1500, STUCK_MS = 8000;  // a recording's least length; a recorder left showing a take
  const state = {};
  let analyser = null, samples = null, denied = false;
  async function listen() {
    if (analyser || denied) return analyser;
    try {
      const stream = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true } });
      const context = new AudioContext();
      analyser = context.createAnalyser();
      analyser.fftSize = 2048;
      context.createMediaStreamSource(stream).connect(analyser);
      samples = new Float32Array(analyser.fftSize);
    } catch (e) {
      denied = true;  // the recorder itself says how to allow the microphone
    }
    return analyser;
  }
  function level() {
    analyser.getFloatTimeDomainData(samples);
    let sum = 0;
    for (const v of samples) sum += v * v;
    return Math.sqrt(sum / samples.length);
  }
  const visible = (el) => el && el.offsetParent !== null;
  setInterval(async () => {
    for (const prefix of composers) {
      if (!document.querySelector(`#${prefix}-voice input`)?.checked) { delete state[prefix]; continue; }
      if (!(await listen())) continue;
      const st = (state[prefix] ||= { heard: false, loudAt: 0, asked: false });
      const box = document.querySelector(`#${prefix}-input textarea`);
      const send = document.getElementById(`${prefix}-send`);
      if (st.asked && box?.value.trim() && visible(send)) {  // the question's words are in: send them
        st.asked = false;
        send.disabled = false;
        send.click();
      }
      const mic = document.getElementById(`${prefix}-mic`);
      const record = mic?.querySelector("button.record-button");
      const stopRecording = mic?.querySelector("button.stop-button");
      const loud = level() > LOUD, now = Date.now();
      if (now - (st.clickedAt || 0) < 1000) continue;  // the recorder is still starting or stopping
      if (loud) st.loudAt = now;
      if (visible(stopRecording)) {  // recording
        st.idleAt = 0;
        st.since ||= now;
        if (loud && !st.heard) {
          st.heard = true;
          const audio = document.getElementById(`${prefix}-speaker-audio`);
          if (audio && !audio.paused) audio.pause();  // barge in: the reply is silenced and stopped
          const stop = document.getElementById(`${prefix}-stop`);
          if (visible(stop)) stop.click();
        } else if (st.heard && now - st.loudAt > QUIET_MS && now - st.since > SHORTEST_MS) {
          st.heard = false;
          st.asked = true;
          st.since = 0;
          st.clickedAt = now;
          stopRecording.click();
        }
      } else if (visible(record)) {  // idle: listen for the next question
        st.heard = false;
        st.since = 0;
        st.clickedAt = now;
        record.click();
      } else if ((st.idleAt ||= now) && now - st.idleAt > STUCK_MS) {  // a take the page could not read: drop it
        st.idleAt = 0;
        mic?.querySelector("button[aria-label='Clear']")?.click();
      }
    }
  }, 100);
})();
