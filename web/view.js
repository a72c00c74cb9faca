// A view the frontend hands an element to (the sidebar tab, the bottom panel tab): it draws into
// a root of its own, only while that root shows. The frontend may call render() again with the
// same element (a re-render of its slot) or a new one (a tab switched away and back), and may
// keep a closed view in the page, hidden or detached: each case is handled here once.

const CSS_URL = new URL("./panel.css", import.meta.url).href;

// Resolves once the stylesheet has loaded (or failed to): a view draws again then, since what
// it measures after drawing (web/timeline.js fitPicture) depends on the styles.
let stylesReady = null;
function loadStyles() {
  stylesReady ??= new Promise((resolve) => {
    const link = document.createElement("link");
    link.rel = "stylesheet";
    link.href = CSS_URL;
    link.addEventListener("load", resolve);
    link.addEventListener("error", resolve);
    document.head.appendChild(link);
  });
  return stylesReady;
}

export class View {
  // `id`, `className`: the root element's. Subclasses draw in render(), add their listeners in
  // setUp(root) and drop their timers in tearDown().
  constructor(id, className) {
    this.rootId = id;
    this.rootClass = className;
    this.root = null;
    this.dirty = true;
    this.frame = 0;
    this.observer = null;
    this.resizes = null;
    this.width = 0;  // the root's width when it was last drawn
  }

  mount(el) {
    if (this.root && this.root.parentElement === el) { this.update(); return; }
    this.unmount();
    loadStyles().then(() => this.update());
    const root = document.createElement("div");
    root.id = this.rootId;
    root.className = this.rootClass;
    this.setUp(root);
    el.replaceChildren(root);
    this.root = root;
    // Handles frontends that keep a closed tab alive but hidden: draw again once it shows.
    this.observer = new IntersectionObserver((entries) => {
      if (entries.some((x) => x.isIntersecting) && this.dirty) this.update();
    });
    this.observer.observe(root);
    // What is fitted to the width after drawing (labels, tick numbers, marks) is fitted again when
    // the width changes: a window resized, the sidebar dragged wider.
    this.resizes = new ResizeObserver(() => {
      if (this.root && Math.abs(this.root.clientWidth - this.width) >= 1) this.update();
    });
    this.resizes.observe(root);
    this.dirty = true;
    this.render();
    this.width = root.clientWidth;
  }

  unmount() {
    cancelAnimationFrame(this.frame);
    this.tearDown();
    this.observer?.disconnect();
    this.observer = null;
    this.resizes?.disconnect();
    this.resizes = null;
    this.frame = 0;
    this.root = null;
  }

  isMounted() {
    return !!this.root;
  }

  isOpen() {
    return !!this.root && this.root.isConnected && this.root.getClientRects().length > 0;
  }

  // Cheap to call from any event: while the view is closed it only marks it stale.
  update() {
    this.dirty = true;
    if (!this.isOpen() || this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.render();
      if (this.root) this.width = this.root.clientWidth;
    });
  }

  setUp(_root) {}

  tearDown() {}

  render() {}
}
