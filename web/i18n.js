// The panel's words, in the user's language.
//
// The words live in the pack's locales/<lang>/main.json under "tieredOffload"; ComfyUI serves
// every pack's locales/ at /i18n and the frontend merges them into its own vue-i18n messages.
// ComfyUI's extension API has no translate function (app.extensionManager offers toast,
// setting, command, dialog, sidebarTab, workflow...; window.comfyAPI no i18n module; checked in
// frontends 1.32.9 and 1.49.6), so the words are read from the frontend's vue-i18n through the
// standard global property of its Vue app (`$tm`, the raw message in the current language with
// the frontend's own fallback to English). Where that is absent, ENGLISH below is used: it is
// the same text as locales/en/main.json (tests/test_i18n.py holds them equal).
//
// Placeholders are `{name}` and are filled here, not by vue-i18n: the frontend escapes
// interpolated values for HTML (escapeParameter), and the panel escapes its own markup.

export const NAMESPACE = "tieredOffload";

export const ENGLISH = {
  tab: {
    title: "Offload",
    tooltip: "Offload: every loaded model, in VRAM / RAM / disk",
  },
  panel: {
    title: "Tiered Offload",
    refresh: "Reload from server",
    loading: "Loading…",
    empty: "No model loaded yet. Every model ComfyUI loads appears here, from any loader.",
    models: "Models",
    hiddenCore: "{n} hidden: loaded by ComfyUI alone (see the settings)",
    unavailable: "Server side not available: this ComfyUI has no /api/offload/tiers route. Update comfyui-tiered-offload and restart ComfyUI.",
    getFailed: "GET /api/offload/tiers failed: {error}",
    noDevices: "No device figures.",
    dismiss: "Dismiss",
    http: "{error} (HTTP {status})",
  },
  devices: {
    vram: "VRAM",
    pinned: "Pinned",
    ram: "RAM",
    usedOfTotal: "{used} / {total}",
    used: "used {size}",
    free: "free {size}",
    reserved: "reserved {size}",
    pinnedOfBudget: "{pinned} of {budget} budget",
    pinnedNoBudget: "{pinned} of no budget",
    pinnedSize: "pinned {size}",
    held: {
      tier_models: "VRAM Tier Manager models {size}",
      swap_masters: "Model-Level Swap masters {size}",
      layerwise_packs: "Apply Layerwise Offload blocks {size}",
      disk_cache: "disk streaming cache {size}",
    },
    otherTitle: "everything else (ComfyUI, models it loaded itself, other programs) {size}",
    otherSize: "other {size}",
    availableSize: "available {size}",
    availableOfTotal: "{available} available of {total}",
    ramBudgetMarker: "RAM budget {size}",
    device: "Device",
    cpuOnly: "CPU: no GPU, so no VRAM tier",
    unifiedMemory: "Apple silicon: the GPU shares the RAM, so the offload nodes pass models through",
    pinnedNoGpu: "none without a GPU",
  },
  placement: {
    vram: "VRAM {size}",
    ram: "RAM {size}",
    disk: "disk only {size}",
    total: "= {size}",
    vramAll: "VRAM: all {size}",
    ramAll: "RAM: all {size}",
    diskAll: "disk only: all {size}",
    parts: "counted as blocks {blocks} (the engine's pack) + the rest {rest} (ComfyUI's)",
  },
  blocks: {
    legend: {
      resident: "resident in VRAM",
      streamed: "streamed from RAM",
      in_flight: "in a VRAM slot now",
      cached: "in the RAM cache (disk streaming)",
      disk: "on disk only (disk streaming)",
    },
    place: {
      resident: "in VRAM",
      in_flight: "in a VRAM slot",
      cached: "in the RAM cache",
      disk: "on disk",
      streamed: "in RAM",
    },
    corePlace: {
      resident: "kept in VRAM by ComfyUI",
      partial: "partly in VRAM (ComfyUI)",
      streamed: "streamed by ComfyUI",
    },
    cell: "block {index}: {place}",
    strip: "blocks",
    legendCpu: {
      resident: "resident: copied once per run",
      streamed: "streamed: copied in every pass",
      in_flight: "in a slot now",
      cached: "in the RAM cache (disk streaming)",
      disk: "on disk only (disk streaming)",
    },
    placeCpu: {
      resident: "resident",
      in_flight: "in a slot",
      cached: "in the RAM cache",
      disk: "on disk",
      streamed: "streamed",
    },
    source: {
      file: "read in place from the model file",
      checking: "read in place from the model file (checked at its first read)",
      spill: "from the spill file",
      mixed: "from the model file and the spill file",
    },
  },
  stats: {
    noRun: "No sampling run yet.",
    computeWaited: "compute waited",
    computeWaitedTitle: "time compute waited for streamed units' bytes: each unit's wait, and the copies the sampling thread made itself (on a CPU, every copy). The picture of a pass counts the same way.",
    engineOnHost: "engine on host",
    engineOnHostTitle: "time the sampling thread spent in the engine: issuing copies and merges, and waiting for them",
    overlap: "overlap",
    overlapTitle: "share of the run neither compute nor the sampling thread waited",
    run: "run",
    runTitle: "the last sampling run",
    copied: "copied",
    copiedTitle: "bytes copied from RAM to VRAM, and how many copies",
    peak: "peak in VRAM",
    peakTitle: "most block bytes in VRAM at once",
    fallbacks: "fallbacks",
    fallbacksTitle: "synchronous copies",
    orderMisses: "order misses",
    orderMissesTitle: "blocks run out of order",
    unusedCopies: "copied, not run",
    unusedCopiesTitle: "block copies that no call ran before their slot was needed again: a call skipped those blocks (skip-layer guidance, a block cache)",
    diskRead: "disk read",
    diskReadTitle: "bytes read from disk over the time spent reading",
    cacheHits: "cache hits",
    cacheHitsTitle: "streamed units found in the RAM cache",
    diskWait: "waited for disk",
    diskWaitTitle: "time compute waited for a disk read",
    readErrors: "read errors",
    readErrorsTitle: "failed disk reads",
    seconds: "{value} s",
    copiedPerSecond: "copied per second",
    copiedPerSecondTitle: "bytes copied over the whole sampling run, compute included: not the speed of the copies themselves (the picture's link rate is)",
    shareOfRun: "{share}% of the run",
    copiedCpu: "copied",
    copiedCpuTitle: "bytes copied into the engine's buffers (in RAM: the device is the CPU), and how many copies",
    peakCpu: "peak in buffers",
    peakCpuTitle: "most block bytes in the engine's buffers at once (in RAM: the device is the CPU)",
  },
  layerwise: {
    head: "Streamed by Apply Layerwise Offload",
    blocks: "{n} blocks",
    asPhases: "as {n} phases",
    counts: "{resident} resident · {streamed} streamed",
    bound: "at most {size} in VRAM",
    fromDisk: "from disk through {size} RAM cache",
    cost: "Cost: {cost}",
    pill: "streamed",
    boundCpu: "at most {size} of block copies at once",
    blocksOne: "1 block",
    inPlace: "{n} units ({size}) read in place from {file}",
    spilled: "{n} units in a spill file ({size} written)",
    noSpill: "no spill file",
  },
  plan: {
    head: "Auto settings",
    headFixed: "Settings fixed on the node",
    resident: "{n} of {blocks} blocks resident",
    prefetch: "prefetch {n}",
    readAhead: "read-ahead {n}",
    check: "predicted {predicted} a step, measured {measured}:",
    checkCalls: "predicted {predicted} a call of the model, measured {measured} (the mean of calls {first}–{last}; a step of the progress bar may hold more than one call, and the sampler's own work):",
    measuring: "measuring the first steps of this run…",
    planning: "choosing a setting from the steps measured (the run goes on meanwhile)…",
    autoWould: "auto would choose {setting}: {ms} a step {how}",
    autoWouldNoise: "auto would choose {setting}: the same step, within this run's spread, in less VRAM",
    faster: "faster",
    slower: "slower",
    changesOne: "1 change this run, before pass {pass}: {setting}",
    changes: "{n} changes this run, the last before pass {pass}: {setting}",
    changesRunsOne: "1 change, before run {pass}: {setting}",
    changesRuns: "{n} changes, the last before run {pass}: {setting}",
    nextRunEnded: "the next run starts with {setting} (planned at the end of this one)",
    nextRunShort: "the next run starts with {setting} (planned at pass {pass}, with {n} of this run's calls left: too few to repay the change)",
    measuringRun: "timing this run's blocks…",
    measuredRun: "measured {measured} a step; the next run's order is chosen from it",
    measuredFixed: "measured {measured} a step in the order fixed on the node",
    verdict: {
      as_predicted: "as predicted",
      faster: "faster than predicted",
      slower: "slower than predicted",
      rolled_back: "slower than predicted, and than the setting before: rolled back",
      partial_passes: "the model's passes do not run every block: the setting stays",
      no_faster: "the planned setting measured no faster in this run: the setting stays",
      measuring: "measuring",
    },
  },
  timeline: {
    head: "Last run, one pass of the model",
    summary: "{units} streamed units · pass {ms} ms",
    boundBy: "Bound by: {what}",
    bound: {
      link: "link (compute waited for copies)",
      disk: "disk (compute waited for reads)",
      compute: "compute (copies hidden behind it)",
      compute_between_copies: "compute (copies ran between blocks, briefly)",
      copies: "copies (each block was copied between the others, on the CPU)",
    },
    kind: {
      disk: "disk read",
      copy: "copy",
      wait: "compute waited",
      compute: "compute",
      resident: "resident (not streamed)",
    },
    span: "{kind}: {start} to {end} ms",
    row: "block {block}",
    rowPhase: "block {block} · {name}",
    axis: "ms from the pass start",
    notRecorded: "No picture of the last run: no Offload panel was open when it began. Keep this panel open and run the workflow again. ComfyUI reuses a finished result while nothing changes, so change the seed (or any input) first.",
    figure: "time line of the last pass",
    tab: "Offload timeline",
    openFull: "Open full view",
    openFullTitle: "Show this picture full width in the bottom panel: one labelled row per unit, with the verdict and figures beside it",
    openFailed: "Offload: the full view did not open",
    passStart: "pass start",
    ahead: "fetched ahead",
    aheadSqueezed: "Drawn shorter than to scale: it took {ms} ms.",
    aheadNote: "Shaded, left of 0: {units} units were read and copied during the previous pass (the prefetch runs ahead), so the axis starts before this pass does.",
    startExplain: "(0 ms): compute asks for this pass's first streamed unit. Every time on the axis counts from here.",
    aheadExplain: "(shaded, left of 0): while the previous pass computed its last units, the prefetch was already reading and copying the first units of this one. They are drawn in this pass because this pass computes them; their reads and copies simply started earlier. A pass starts with prefetch + 1 units fetched: the one compute asks for first, and the prefetch after it.",
    rowsExplain: "One row per streamed unit, top to bottom in the order they computed. Point at a bar for its times.",
    nothingStreamed: "Nothing streamed in the last run: every block stayed resident, so there were no copies to picture.",
    noPicture: "No picture yet. Keep the Offload panel or this view open while a workflow with Apply Layerwise Offload runs. ComfyUI reuses a finished result while nothing changes, so change the seed (or any input) before you run it again.",
    msValue: "{value} ms",
    aheadFigure: "{units} units, up to {ms} ms before",
    figures: {
      pass: "pass",
      passTitle: "from the first unit's wait to the last unit's compute",
      units: "streamed units",
      unitsTitle: "units copied to the device in this pass, one row each",
      compute: "compute",
      computeTitle: "time the streamed units computed",
      copyBusy: "link busy",
      copyBusyTitle: "time at least one copy to the device ran",
      diskBusy: "disk busy",
      diskBusyTitle: "time at least one disk read ran",
      ahead: "fetched ahead",
      aheadTitle: "units whose reads or copies began during the previous pass, and how early the first began",
      waited: "compute waited",
      waitedTitle: "time compute waited for this pass's units: their waits, and the copies the sampling thread made itself. The card's compute waited counts the whole run the same way.",
      forDisk: "of it, for disk",
      forDiskTitle: "the waits for units still being read from disk",
      linkRate: "link rate",
      linkRateTitle: "bytes copied in this pass over the time copies ran: the speed of the copies themselves",
    },
    totalsCompute: "compute {compute} ms",
    totalsWaited: "compute waited {waited} ms ({share}% of the pass)",
    totalsForDisk: "of it for disk {disk} ms",
    rows: "blocks {blocks}",
    residentRow: "block {blocks} · resident",
    residentRows: "blocks {blocks} · resident",
    residentSpan: "{blocks} resident: computed between {start} and {end} ms, with the engine's work between units (not streamed, so not timed on its own)",
    residentUntimed: "{blocks} resident: computed before or after the streamed units (not timed)",
    residentExplain: "(hatched): resident units are never copied during a pass, so the engine does not time them; their row shows where they computed, between the streamed units before and after them.",
    aheadNotePrefetch: "Shaded, left of 0: {units} units were copied during the previous pass: the unit this pass computes first and the {prefetch} after it (prefetch {prefetch}). So the axis starts before this pass does.",
    aheadFigurePrefetch: "{units} units (the first + prefetch {prefetch}), up to {ms} ms before",
    shareOfPass: "{value} ({share}% of the pass)",
    rate: "{size}/s",
    summaryOne: "1 streamed unit · pass {ms} ms",
    aheadNoteOne: "Shaded, left of 0: 1 unit was read and copied during the previous pass (the prefetch runs ahead), so the axis starts before this pass does.",
    aheadFigureOne: "1 unit, up to {ms} ms before",
  },
  dynamic: {
    head: "Streamed by ComfyUI (Dynamic VRAM) in the order of Apply Layerwise Offload",
    summary: "{blocks} blocks · {kept} kept in VRAM · {streamed} streamed",
    afterRun: "(after the last run)",
    planned: "(as planned)",
    inForce: "Order: the node's {n} resident blocks first, in force",
    relaidOut: "(laid out again {n}×)",
    fixedEarlier: "Order already fixed by an earlier load; it takes effect after the model is reloaded.",
    notLoadedYet: "Order: not loaded yet",
    order: "Order: {order}",
    pill: "core streams · ordered",
    pillTitle: "ComfyUI streams it with Dynamic VRAM, in the order of Apply Layerwise Offload",
  },
  swap: {
    pill: "swapped",
    master: "master {size}",
    heldFromEarlier:
      "Not swapped in the last prompt: ComfyUI still holds this model from an earlier workflow, and its master stays in RAM as long as it does. Unload frees both.",
    figures: "Model-Level Swap: {turns}, {parks} without a copy back",
    turnsOne: "1 turn",
    turnsMany: "{n} turns",
    parksOne: "1 park",
    parksMany: "{n} parks",
  },
  hostStore: {
    sharedMemory: "Host copy: {size} in shared memory",
    sharedDisk: "Host copy: {size} in a shared file on disk",
    sharedAlone: "no other process maps it now",
    sharedWithOne: "shared with 1 other process",
    sharedWith: "shared with {n} other processes",
    sharedUnknown: "shared with the machine's other processes",
    private: "Host copy: this process's own ({why})",
  },
  kind: {
    diffusion_model: "diffusion model",
    checkpoint: "checkpoint",
    clip: "text encoder",
    text_encoder: "text encoder",
    vae: "VAE",
    model: "model",
  },
  card: {
    tierManaged: "tier-managed",
    tierManagedTitle: "Kept by the VRAM Tier Manager across workflows",
    inUse: "in use",
    inUseTitle: "running prompts that use it: {n}",
    loadsTitle: "the times a workflow or the panel asked for it: read from disk, brought back from RAM, or found loaded already",
    loadsOne: "1 load ({disk} from disk, {ram} from RAM, {loaded} already loaded)",
    loadsMany: "{n} loads ({disk} from disk, {ram} from RAM, {loaded} already loaded)",
    keepInRam: "keep in RAM",
    keepInRamTitle: "Never drop this model to disk (it may still be parked from VRAM to RAM)",
    priority: "priority",
    priorityTitle: "Higher priority models are evicted later (-100 to 100)",
    priorityInvalid: "a whole number from -100 to 100",
    core: "core · {device}",
    coreHere: "core",
    coreTitle: "Loaded by ComfyUI on {device}",
    notLoaded: "Not loaded by ComfyUI now: ComfyUI still keeps this earlier load, and the pack holds its weights in RAM. Unload frees them.",
    fileNotRecorded: "file not recorded by this ComfyUI",
    badgeTitle: {
      vram: "In VRAM: loaded by ComfyUI on the GPU",
      cpu: "Loaded by ComfyUI on the CPU: no GPU, so its weights are in RAM",
      ram: "In RAM, not loaded by ComfyUI",
      disk: "On disk only: it holds no RAM",
    },
  },
  actions: {
    load: {
      label: "Load",
      title: "Load into VRAM",
      titleCpu: "Have ComfyUI load it (on the CPU: its weights stay in RAM)",
    },
    park: {
      label: "Park",
      title: "Park in RAM (drop the GPU copy)",
      titleCpu: "ComfyUI unloads it; its weights stay in RAM",
    },
    evict: {
      label: "Evict",
      title: "Drop to disk (free its RAM)",
      titleKept: "Kept in RAM: turn Keep in RAM off to evict it to disk",
    },
    unload: {
      label: "Unload",
      title: "Core's own unload, as core does to make room; offered between prompts",
      titleHeld: "ComfyUI no longer holds this model: free what the pack still holds of it (its pinned copy); offered between prompts",
    },
    policy: {
      label: "Policy",
    },
    budgets: {
      label: "Budgets",
    },
  },
  refusal: {
    notice: "{action} refused: {error}",
    toast: "Offload: {action} refused",
    toastDetail: "“{model}”: {error}",
  },
  promptError: {
    toast: "Tiered Offload: {node} failed",
  },
  ago: {
    never: "never",
    now: "just now",
    seconds: "{n} s ago",
    minutes: "{n} min ago",
    hours: "{n} h ago",
    days: "{n} d ago",
  },
  budgets: {
    ramBudget: "RAM budget",
    ramBudgetTitle: "Cap on RAM held by models the manager keeps; empty: only the reserve limits it",
    ramReserve: "RAM reserve",
    ramReserveTitle: "RAM always left free for ComfyUI and the system",
    vramReserve: "VRAM reserve",
    vramReserveTitle: "VRAM kept free when the manager loads models itself",
    diskTier: "Disk tier",
    diskTierTitle: "Allow dropping idle models to disk when RAM is over budget",
    auto: "auto",
    autoOf: "auto ({size})",
    shownBudget: "RAM budget {size}",
    shownRamReserve: "RAM reserve {size}",
    shownVramReserve: "VRAM reserve {size}",
    diskOn: "disk tier on",
    diskOff: "disk tier off",
    edit: "Edit budgets and the disk tier",
    save: "Save",
    cancel: "Cancel",
    notGib: "{field} must be a number of GiB ≥ 0",
  },
};

const asked = new Set();

function lookup(tree, key) {
  let node = tree;
  for (const part of key.split(".")) {
    if (node === null || typeof node !== "object" || !(part in node)) return undefined;
    node = node[part];
  }
  return node;
}

// The frontend's vue-i18n, through its Vue app's global properties; null where it is absent.
function frontendI18n() {
  const props = document.getElementById("vue-app")?.__vue_app__?.config?.globalProperties;
  return typeof props?.$tm === "function" ? props : null;
}

// The key as the frontend knows it: the sidebar tab takes its title and tooltip as keys, which
// the frontend translates itself (its own tabs are registered the same way).
export function frontendKey(key) {
  return `${NAMESPACE}.${key}`;
}

// The text for a key of ENGLISH, in the frontend's language, with {name} placeholders filled.
export function tr(key, params) {
  asked.add(key);
  let text = lookup(ENGLISH, key);
  const i18n = frontendI18n();
  if (i18n) {
    try {
      const message = i18n.$tm(frontendKey(key));
      if (typeof message === "string" && message) text = message;
    } catch {
      /* English below */
    }
  }
  if (typeof text !== "string") text = key;
  if (!params) return text;
  return text.replace(/\{(\w+)\}/g, (whole, name) => (name in params ? String(params[name]) : whole));
}

// Every key the panel has asked for since the page loaded (the locale test checks them).
export function askedKeys() {
  return [...asked].sort();
}
