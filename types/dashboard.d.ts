// What the dashboard's modules (static/**/*.js) find outside themselves,
// for `tsc --checkJs` (tsconfig.json); nothing here is served.

/** uPlot, loaded by static/index.html from static/vendor/uplot as a global
 * script; its options are checked by the browser tests, not typed here. */
declare const uPlot: any;

interface Window {
  /** The dashboard's handles for tests and curious users: every chart by
   * name (its uPlot instance, `chart.data`), and whatever a page adds. */
  polyak: { charts?: Record<string, any>; [key: string]: any };
}
